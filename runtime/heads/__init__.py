"""Learned draft heads: the EAGLE head (``eagle.py``) and ``specgraph distill``, which makes one for a
target from data it builds itself (``distill.py``, ``distill_data.py``). Heads made for the embedded
models ship in ``shipped/``."""
