// What qmatmul_body.inc needs, included before any target pragma.
#pragma once
#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "qmatmul.h"
