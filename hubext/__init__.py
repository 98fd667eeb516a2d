"""The hub side: spawners, the GPU broker API, pool backends and the admin page."""
