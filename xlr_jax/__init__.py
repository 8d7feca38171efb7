"""xlr-jax: a JAX research runtime for fast LLM inference."""
from xlr_jax.api import Model, load_model
from xlr_jax.errors import (InvalidRequestError, ModelLoadError, OutOfPagesError, PlanError,
                            PromptTooLongError, QueueFullError, TokenizerError,
                            UnsupportedModelError, XlrError)
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.planning.hardware import HardwareProfile, probe
from xlr_jax.planning.mapper import ExecutionPlan, Workload, plan
from xlr_jax.runtime.request import GenerationResult
from xlr_jax.runtime.loop import RequestHandle

__all__ = ["load_model", "Model", "ModelConfig", "GenerationResult", "SamplingParams",
           "probe", "HardwareProfile", "plan", "ExecutionPlan", "Workload",
           "XlrError", "ModelLoadError", "UnsupportedModelError", "TokenizerError",
           "InvalidRequestError", "PromptTooLongError", "OutOfPagesError", "PlanError",
           "QueueFullError", "RequestHandle"]
__version__ = "0.1.0"
