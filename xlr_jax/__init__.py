"""xlr-jax: a JAX research runtime for fast LLM inference."""
from xlr_jax.api import Model, load_model
from xlr_jax.config import ModelConfig
from xlr_jax.engine import GenerationResult
from xlr_jax.errors import (InvalidRequestError, ModelLoadError, OutOfPagesError,
                            PromptTooLongError, TokenizerError, UnsupportedModelError, XlrError)
from xlr_jax.sampling import SamplingParams

__all__ = ["load_model", "Model", "ModelConfig", "GenerationResult", "SamplingParams",
           "XlrError", "ModelLoadError", "UnsupportedModelError", "TokenizerError",
           "InvalidRequestError", "PromptTooLongError", "OutOfPagesError"]
__version__ = "0.1.0"
