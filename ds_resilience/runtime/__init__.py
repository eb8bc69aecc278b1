"""Runtime (layer L3, torch): executing one worker's schedule, messages, groups, B/W split."""

__all__: list[str] = []
