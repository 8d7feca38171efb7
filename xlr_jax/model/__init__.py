"""The model on the device: config, the pure decoder, sampling and the jitted steps."""
