"""The Hugging Face demo: ``python -m examples.hf_causal_lm.run`` (docs/hf.md, "The demo")."""
