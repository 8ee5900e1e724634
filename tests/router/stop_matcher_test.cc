// Stop strings over streamed text: nothing of a stop string is ever sent,
// text that cannot start one is not held, and the cut is exact.
#include "router/stop_matcher.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

// Feeds `pieces` one by one; returns what was sent (pieces joined with '|'
// so the timing of each release is visible) and the flushed tail.
std::string Feed(StopStringMatcher& m, const std::vector<std::string>& pieces) {
  std::string out;
  for (const std::string& p : pieces) {
    out += m.Append(p);
    out += "|";
  }
  return out;
}

TEST(StopStringMatcherTest, PassesTextThroughWithoutStops) {
  StopStringMatcher m({});
  EXPECT_EQ(Feed(m, {"Hello", ", ", "world"}), "Hello|, |world|");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringMatcherTest, HoldsBackOnlyWhatCouldStartAStop) {
  StopStringMatcher m({"END"});
  // "E" and "EN" could grow into "END"; "EX" cannot.
  EXPECT_EQ(Feed(m, {"abc E", "N", "x"}), "abc ||ENx|");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(Feed(m, {"E"}), "|");
  EXPECT_EQ(m.Flush(), "E");  // The stream ended first: the tail is text.
}

TEST(StopStringMatcherTest, CutsBeforeAStopSplitAcrossPieces) {
  StopStringMatcher m({"STOP"});
  EXPECT_EQ(Feed(m, {"one S", "T", "O", "P two"}), "one ||||");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.Append("more"), "");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringMatcherTest, StopInsideOnePiece) {
  StopStringMatcher m({"\n\n"});
  EXPECT_EQ(m.Append("line\n\nnext"), "line");
  EXPECT_TRUE(m.stopped());
}

TEST(StopStringMatcherTest, EarliestOfSeveralStopsWins) {
  StopStringMatcher m({"world", "lo"});
  EXPECT_EQ(m.Append("hello world"), "hel");
  EXPECT_TRUE(m.stopped());

  // A stop complete now ends the text, even if a longer one that began
  // earlier might still have completed.
  StopStringMatcher n({"abcd", "c"});
  EXPECT_EQ(Feed(n, {"xab"}), "x|");
  EXPECT_EQ(n.Append("c"), "ab");
  EXPECT_TRUE(n.stopped());
}

TEST(StopStringMatcherTest, OverlappingPrefixesKeepTheLongestCandidate) {
  StopStringMatcher m({"aab"});
  // "aa" then "a": the tail "aa" is still a candidate, the first 'a' is not.
  EXPECT_EQ(Feed(m, {"aa", "a", "b!"}), "|a||");
  EXPECT_TRUE(m.stopped());
}

TEST(StopStringMatcherTest, MultiByteUtf8StopsAndText) {
  // "é" is C3 A9; "ö" is C3 B6. A held tail may end inside a stop's
  // character, but what is released is always whole characters.
  StopStringMatcher m({"wörld"});
  std::string sent = m.Append("héllo w\xC3");  // Incomplete in the stop only.
  EXPECT_EQ(sent, "héllo ");
  sent = m.Append("\xB6rld and more");
  EXPECT_EQ(sent, "");
  EXPECT_TRUE(m.stopped());

  StopStringMatcher n({"ö!"});
  EXPECT_EQ(n.Append("aö"), "a");
  EXPECT_EQ(n.Append("é"), "öé");  // "öé" does not start "ö!".
  EXPECT_FALSE(n.stopped());

  StopStringMatcher cjk({"。"});
  EXPECT_EQ(cjk.Append("你好。再见"), "你好");
  EXPECT_TRUE(cjk.stopped());
}

TEST(StopStringMatcherTest, StopAtTheVeryStart) {
  StopStringMatcher m({"x"});
  EXPECT_EQ(m.Append("xyz"), "");
  EXPECT_TRUE(m.stopped());
}

}  // namespace
}  // namespace pdserve
