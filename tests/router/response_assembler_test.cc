// Assembling public responses from sampled tokens: text deltas never split
// a UTF-8 character, special tokens are skipped, stop strings cut the text,
// logprobs map one to one, and the last message carries finish and usage.
#include "router/response_assembler.h"

#include <string>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;

wire::SampledToken Tok(int32_t id, float logprob = -1.0f) {
  wire::SampledToken t;
  t.set_token_id(id);
  t.set_logprob(logprob);
  return t;
}

class ResponseAssemblerTest : public ::testing::Test {
 protected:
  std::unique_ptr<Tokenizer> tokenizer_ = Tokenizer::MakeByteLevel();
  ResponseAssembler::Options Options() {
    return {
        .tokenizer = tokenizer_.get(), .request_id = "r1", .prompt_tokens = 3};
  }
};

TEST_F(ResponseAssemblerTest, Utf8CharactersSplitAcrossTokensComeOutWhole) {
  ResponseAssembler a(Options());
  v1::GenerateResponse m = a.NewMessage();
  ASSERT_TRUE(a.AddToken(Tok('a'), &m).ok());
  ASSERT_TRUE(a.AddToken(Tok(0xC3), &m).ok());
  EXPECT_EQ(m.text(), "a");  // Half of "é" is held.
  v1::GenerateResponse m2 = a.NewMessage();
  ASSERT_TRUE(a.AddToken(Tok(0xA9), &m2).ok());
  EXPECT_EQ(m2.text(), "é");
  EXPECT_EQ(m2.request_id(), "r1");
  EXPECT_EQ(m2.token_ids_size(), 1);
}

TEST_F(ResponseAssemblerTest, FinalMessageHasFinishUsageAndSkipsSpecialTokens) {
  ResponseAssembler a(Options());
  v1::GenerateResponse m = a.NewMessage();
  for (int id : {int{'o'}, int{'k'}, 257})
    ASSERT_TRUE(a.AddToken(Tok(id), &m).ok());
  a.Finish(v1::FINISH_REASON_STOP, &m);
  EXPECT_EQ(m.text(), "ok");
  EXPECT_EQ(m.token_ids_size(), 3);
  EXPECT_EQ(m.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(m.usage().prompt_tokens(), 3u);
  EXPECT_EQ(m.usage().completion_tokens(), 3u);
  EXPECT_EQ(m.logprobs_size(), 0);
}

TEST_F(ResponseAssemblerTest, SpecialTokensShownWhenAsked) {
  ResponseAssembler::Options o = Options();
  o.skip_special_tokens = false;
  ResponseAssembler a(o);
  v1::GenerateResponse m = a.NewMessage();
  for (int id : {int{'o'}, 257}) ASSERT_TRUE(a.AddToken(Tok(id), &m).ok());
  a.Finish(v1::FINISH_REASON_STOP, &m);
  EXPECT_EQ(m.text(), "o</s>");
}

TEST_F(ResponseAssemblerTest, StopStringCutsTextButCountsItsTokens) {
  ResponseAssembler::Options o = Options();
  o.stop_strings = {"lo w"};
  ResponseAssembler a(o);
  v1::GenerateResponse m = a.NewMessage();
  for (char c : std::string("hello world")) {
    ASSERT_TRUE(a.AddToken(Tok(static_cast<uint8_t>(c)), &m).ok());
    if (a.stopped()) break;
  }
  ASSERT_TRUE(a.stopped());
  a.Finish(v1::FINISH_REASON_LENGTH, &m);
  EXPECT_EQ(m.text(), "hel");
  EXPECT_EQ(m.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(m.usage().completion_tokens(), 7u);  // "hello w"
  EXPECT_EQ(m.token_ids_size(), 7);
}

TEST_F(ResponseAssemblerTest, HeldTailIsReleasedAtTheEnd) {
  ResponseAssembler::Options o = Options();
  o.stop_strings = {"xyz"};
  ResponseAssembler a(o);
  v1::GenerateResponse m = a.NewMessage();
  for (char c : std::string("abxy")) ASSERT_TRUE(a.AddToken(Tok(c), &m).ok());
  EXPECT_EQ(m.text(), "ab");
  v1::GenerateResponse last = a.NewMessage();
  a.Finish(v1::FINISH_REASON_LENGTH, &last);
  EXPECT_EQ(last.text(), "xy");
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_LENGTH);
}

TEST_F(ResponseAssemblerTest, LogprobsMapOneToOne) {
  ResponseAssembler::Options o = Options();
  o.logprobs = true;
  ResponseAssembler a(o);
  v1::GenerateResponse m = a.NewMessage();
  wire::SampledToken t = Tok('a', -0.25f);
  for (int i = 0; i < 2; ++i) {
    wire::TokenLogprob* top = t.add_top();
    top->set_token_id(100 + i);
    top->set_logprob(-0.1f * (i + 1));
  }
  ASSERT_TRUE(a.AddToken(t, &m).ok());
  ASSERT_TRUE(a.AddToken(Tok('b', -2.0f), &m).ok());
  ASSERT_EQ(m.logprobs_size(), 2);
  EXPECT_EQ(m.logprobs(0).token_id(), 'a');
  EXPECT_FLOAT_EQ(m.logprobs(0).logprob(), -0.25f);
  ASSERT_EQ(m.logprobs(0).top_size(), 2);
  EXPECT_EQ(m.logprobs(0).top(1).token_id(), 101);
  EXPECT_FLOAT_EQ(m.logprobs(0).top(1).logprob(), -0.2f);
  EXPECT_EQ(m.logprobs(1).token_id(), 'b');
}

TEST_F(ResponseAssemblerTest, OutOfVocabularyTokenIsInternal) {
  ResponseAssembler a(Options());
  v1::GenerateResponse m = a.NewMessage();
  EXPECT_EQ(a.AddToken(Tok(5000), &m).code(), absl::StatusCode::kInternal);
}

TEST_F(ResponseAssemblerTest, WithoutTokenizerOnlyIds) {
  ResponseAssembler::Options o = Options();
  o.tokenizer = nullptr;
  ResponseAssembler a(o);
  v1::GenerateResponse m = a.NewMessage();
  ASSERT_TRUE(a.AddToken(Tok(5000), &m).ok());
  a.Finish(v1::FINISH_REASON_LENGTH, &m);
  EXPECT_EQ(m.text(), "");
  EXPECT_EQ(m.token_ids(0), 5000);
}

TEST(MergeResponseTest, AppendsInOrder) {
  v1::GenerateResponse a, b;
  a.add_token_ids(1);
  a.set_text("x");
  b.add_token_ids(2);
  b.set_text("y");
  b.add_logprobs()->set_token_id(2);
  b.set_finish_reason(v1::FINISH_REASON_LENGTH);
  b.mutable_usage()->set_completion_tokens(2);
  MergeResponse(std::move(b), &a);
  EXPECT_EQ(a.token_ids_size(), 2);
  EXPECT_EQ(a.token_ids(1), 2);
  EXPECT_EQ(a.text(), "xy");
  EXPECT_EQ(a.logprobs_size(), 1);
  EXPECT_EQ(a.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(a.usage().completion_tokens(), 2u);
}

}  // namespace
}  // namespace pdserve
