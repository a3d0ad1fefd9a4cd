"""Incidents: Failure, RecoveryDecision, TimelineEvent and the decision state machine."""
