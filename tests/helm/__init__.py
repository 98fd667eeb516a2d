"""Chart checks (lint, template, schema) and the node agent tests."""
