"""Speculative decoding: proposer protocol, the runner's verification step, and engine wiring."""
