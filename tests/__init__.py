"""Tests of Pitstop; the layout mirrors the packages."""
