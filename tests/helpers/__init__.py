"""What tests (and scripts/measure.py) share: model builders, inputs, measurements. Nothing here is a test."""
