//! Model descriptions and the graph builder.
