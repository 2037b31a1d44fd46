"""Talking to other ranks: the collectives seam, the executor that packs every due metric's
requests, and the materialization of Partial placements."""
