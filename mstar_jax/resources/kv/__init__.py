"""KV cache resources."""
