"""Yuxi sessions: durable, cooperating LLM agent sessions on PostgreSQL."""

__version__ = "0.1.0"
