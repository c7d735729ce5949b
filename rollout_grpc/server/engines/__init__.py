"""Engines: the typed engine API every adapter implements, the pool, health and capability checks; one sub-
package per engine kind.
"""
