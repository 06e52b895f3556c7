"""The audit trail: events, redaction, the append-only log, metrics and traces."""
