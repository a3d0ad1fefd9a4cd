"""Jobs: Job, Node and Device, heartbeat ingestion and the failure detector (Django app)."""
