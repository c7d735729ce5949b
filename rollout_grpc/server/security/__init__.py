"""Who may call and how much: authentication and roles, TLS, request bounds and rate limits, redaction."""
