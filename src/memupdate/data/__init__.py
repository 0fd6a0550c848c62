"""Dataset loading, validation and conversion to verl's RLHFDataset rows."""
