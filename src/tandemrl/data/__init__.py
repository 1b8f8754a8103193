"""Data: dataset rows into Examples (load.py), prompts into token ids (prompts.py), and the
resumable order in which examples are drawn (sampler.py)."""
