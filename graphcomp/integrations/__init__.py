"""Integrations of graphcomp with training frameworks (each module imports its framework
on import; this package imports none): :mod:`graphcomp.integrations.hf_trainer`, the
Hugging Face ``Trainer``."""
