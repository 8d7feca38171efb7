"""Speculative decoding: drafts, the jitted cycle, exact acceptance, SMC, and the host runner."""
