"""Engine/EngineRun and the domain engines, which run through Session.
An engine never has a scheduler of its own; imports kernel/ and actors/ only."""

__all__: list[str] = []
