"""One exception base for the package; every message says what to do next."""


class XlrError(Exception):
    """Base class of every error xlr-jax raises on purpose."""


class ModelLoadError(XlrError):
    """The model file or directory is missing, unreadable or corrupt."""


class UnsupportedModelError(XlrError):
    """The architecture, tensor type or rope scheme is not implemented."""


class TokenizerError(XlrError):
    """The tokenizer or chat template cannot be built or rendered."""


class InvalidRequestError(XlrError):
    """A request's prompt or sampling values are out of range."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit in the context or the page pool."""


class PlanError(InvalidRequestError):
    """The model, context or a load option does not fit the device (numbers in the message)."""


class OutOfPagesError(XlrError):
    """The KV page pool has no free page left for a request."""


class QueueFullError(XlrError):
    """More requests are waiting than the model's max_waiting allows; retry later."""


class MemoryMapLimitError(XlrError):
    """One more compiled program would pass the process's memory-map limit."""
