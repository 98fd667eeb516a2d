"""The admission core: pure logic that decides whether a GPU request may run now, where, and who yields."""
