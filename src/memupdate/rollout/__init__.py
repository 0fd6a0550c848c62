"""Rollouts of our agent loops with verl's workers in one process: their configuration and the workers."""
