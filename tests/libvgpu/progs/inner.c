int inner_answer(void) { return 42; }
