"""What a run's config must satisfy before anything starts.

checks.validate_config / ConfigError   # the config's rules: kinds, ranges, combinations
limits.check_limits / LIMITS           # the numeric bounds of every config field
"""
