"""dilocox: train language models across decentralized clusters joined by slow links (DiLoCoX)."""

__version__ = "0.1.0"
