"""Wire formats: strict, bounded msgpack decoding shared by every layer that reads peer bytes."""
