"""Procrastinate app and tasks of Yuxi sessions."""
