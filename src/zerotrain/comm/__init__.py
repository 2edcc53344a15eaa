"""Process groups, launcher, collectives (native | ring) and byte counters."""
