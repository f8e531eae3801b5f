"""Draft blocks, the context a draft source sees, and draft-side rules (confidence truncation)."""
