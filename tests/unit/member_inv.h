/* tests/unit/member_inv.h - the local inventory a daemon serving some ranks of a real model
 * layout holds, built with the real layout code (for the tests of the coordinator and the
 * slices). */
#ifndef RF_TEST_MEMBER_INV_H
#define RF_TEST_MEMBER_INV_H

#include "layout.h"
#include "model.h"

/* Ranks [first, first + n) of layout on side, one endpoint per rank; every tensor of model
 * added in model order. Fails the calling test on any error. */
rf_inv *test_member_inv(const rf_model *model, const char *layout, rf_side side, int first,
                        int n);

#endif
