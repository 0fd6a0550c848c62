"""LoCoMo and MemAgent evaluation: predictions, scores, reports."""
