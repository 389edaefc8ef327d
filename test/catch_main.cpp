// Catch2's main, compiled once into its own object: the single header is slow to compile, the tests are not.
#define CATCH_CONFIG_MAIN
#include <catch.hpp>
