"""The torch reference training code: the Megatron-style training step that real runs execute and the tracer records."""
