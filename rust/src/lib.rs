//! ddtree core: placeholder, filled in by the next commit.
