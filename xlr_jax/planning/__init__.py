"""From hardware and model to an Execution Plan: the probe, the Capability Mapper, the roofline."""
