"""The example application, apart from the library: a byte-level GPT (gpt), its
corpus (data), the training loop behind scripts/train_gpt.py (trainer), its LR
schedule (schedule) and the no-offload baseline it is measured against (baseline).

Nothing in runtime/ outside this package imports it.
"""
