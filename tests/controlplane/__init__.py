"""Tests of the control plane project (settings, embedded services, health, wiring)."""
