"""Offline checkpoint conversions: layouts, upcycling, Hugging Face Mixtral (tools/convert_checkpoint.py)."""
