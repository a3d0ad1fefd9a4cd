"""Tests of the web UI pages."""
