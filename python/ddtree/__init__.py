"""DDTree speculative decoding."""
