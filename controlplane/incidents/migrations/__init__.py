"""Migrations of the incidents app."""
