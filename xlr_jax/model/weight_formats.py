"""The names of the weight formats a load takes (`load_model(weights=...)`), apart from
`model.quantized` (which holds them) so that host-only modules can check a name without
importing jax."""

# quantized at load (`model.quantized.quantize`)
FORMATS = ("int8", "int4", "fp8")
# how a load holds the weight matrices: in the compute dtype, in a GGUF's own formats
# (`model.quantized.GGUF_KEPT`), or quantized at load to one of FORMATS
WEIGHTS = ("float", "native") + FORMATS
