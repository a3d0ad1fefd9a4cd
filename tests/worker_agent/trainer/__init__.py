"""Tests of the reference trainer: model, data, engine, handover, launcher."""
