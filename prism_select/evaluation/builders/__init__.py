"""Evaluation data built from public benchmarks the user points at (nothing is bundled), one
module per source: :mod:`.gsm8k` (GSM8K mistake math), :mod:`.bbh` (BIG-Bench Hard),
:mod:`.trigger` (refusal trigger), :mod:`.multitask` (the general-selection pool) and
:mod:`.common` (what they share)."""
