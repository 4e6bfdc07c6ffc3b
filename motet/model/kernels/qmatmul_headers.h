// What qmatmul_body.inc needs, included before any target pragma.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "qmatmul.h"
