"""xc: distributed extreme-classification training with asynchronous ANNS refresh of hard negatives."""

__version__ = "0.1.0"
