"""Commands that plugins add to ``tmetrics``, found through the entry-point group
``tmetrics.commands`` (each entry a ``click.Command``) and imported only when named or listed,
so core never imports a plugin and a broken plugin breaks only its own command."""

from __future__ import annotations

import importlib.metadata

import click

__all__ = ["COMMANDS_GROUP", "PluginGroup"]

COMMANDS_GROUP = "tmetrics.commands"


class PluginGroup(click.Group):
    """A ``click.Group`` whose commands are its own plus those of ``tmetrics.commands``."""

    def _plugins(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        own = super().get_command(ctx, cmd_name)
        if own is not None:
            return own
        entry = self._plugins().get(cmd_name)
        return entry.load() if entry is not None else None
