// Catch2 v2 main for the torch-free core tests.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
