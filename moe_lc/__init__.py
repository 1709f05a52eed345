"""moe_lc: DeepSeek-style Mixture-of-Experts training on long contexts."""

__version__ = "0.1.0"
